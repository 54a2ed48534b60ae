"""Where `pjit-pipe train` and `pjit-pipe demo` keep compiled programs.

Compiling is most of what a short run waits for (the step and each failure
variant take seconds to tens of seconds), and the programs of two runs with the
same model, mesh and schedule are the same. So both commands use JAX's
persistent compilation cache by default: the first run writes each executable
to disk, a second run loads it instead of compiling. The folder is, in order:
`--cache-dir DIR`; the one JAX is already configured with
(`JAX_COMPILATION_CACHE_DIR`), used as JAX is configured; else a per-user
folder, `$XDG_CACHE_HOME/pjit_pipe/jax` (`~/.cache/pjit_pipe/jax`), where every
program is kept however small or quick to compile. `--no-cache` turns the
cache off, JAX's own included.

The cache is trusted code: a folder that others can write to lets them run
code in this process (JAX's warning on `set_cache_dir`). The per-user folder
is the user's own.
"""

from __future__ import annotations

import argparse
import os
import sys

CACHE_SUBDIR = os.path.join("pjit_pipe", "jax")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """`--cache-dir DIR` and `--no-cache`, which exclude each other.

    Args:
        parser: the subcommand's parser.
    """
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="keep compiled programs here, so a later run loads them instead of compiling "
        "(default: JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/pjit_pipe/jax "
        "or ~/.cache/pjit_pipe/jax)",
    )
    group.add_argument(
        "--no-cache",
        action="store_true",
        help="compile every program and write nothing to disk",
    )


def user_cache_dir() -> str:
    """The per-user folder of compiled programs: $XDG_CACHE_HOME/pjit_pipe/jax, or
    ~/.cache/pjit_pipe/jax when XDG_CACHE_HOME is unset or empty.

    Returns:
        The folder's path (it may not exist yet).
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, CACHE_SUBDIR)


def configure_compilation_cache(cache_dir: str | None, no_cache: bool) -> str | None:
    """Set JAX's persistent compilation cache for this process, before the first
    compile (JAX opens the folder once, at its first compile).

    Args:
        cache_dir: `--cache-dir`, or None for the default folder.
        no_cache: `--no-cache`: turn the cache off.

    Returns:
        The folder in use, or None when the cache is off.

    Raises:
        OptionError: `cache_dir` (or the default folder) names a file, or
            `cache_dir` cannot be created. A default folder that cannot be
            created turns the cache off, with a note on stderr.
    """
    import jax

    from pjit_pipe.errors import OptionError
    from pjit_pipe.runtime import check_cache_dir, use_disk_cache

    if no_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if cache_dir is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir  # the user's own JAX set-up
    folder = cache_dir if cache_dir is not None else user_cache_dir()
    check_cache_dir(folder)  # refuses a file
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        if cache_dir is not None:
            raise OptionError(
                f"cache_dir (--cache-dir): cannot create {folder} ({e.strerror}); give a "
                "folder you can write to, or --no-cache"
            ) from None
        # The default folder is a convenience: without it the run compiles as usual.
        print(f"note: no compilation cache ({folder}: {e.strerror})", file=sys.stderr)
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    use_disk_cache(folder)
    return folder
