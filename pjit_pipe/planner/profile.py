"""Layer profiles: per-layer times and sizes, in a stable topological order.

Two input forms (docs/design.md section 4):

- the DAPPLE/PipeDream text format, one line per node, then edge lines::

      nodeK -- NAME -- forward_compute_time=MS, backward_compute_time=MS, activation_size=BYTES, parameter_size=BYTES
      nodeA -- nodeB

  NAME may hold spaces, parentheses and dashes; activation_size may be a list
  ``[a; b]`` (a node with several outputs: their sizes add up);
- JSON ``{"layers": [{"name", "f", "b", "w"?, "act_bytes", "param_bytes"}],
  "edges"?: [[i, j], ...]}`` (indices into "layers"; without "edges" the
  layers form a chain in the order given).

Times are milliseconds per microbatch of the profiled batch size. A profile
that gives only a backward time b splits it evenly: B = W = b/2. A JSON layer
with "w" says otherwise: then "b" is B alone.

Layers are numbered in a stable topological order: among the nodes whose
predecessors are all placed, the one that comes first in the file. A cut after
layer k carries every tensor whose producer is at or before k and which has a
consumer after k (once per producer), skip edges included: that is what the
two stages on either side of the cut exchange per microbatch.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pjit_pipe.errors import PjitPipeError


class ProfileError(PjitPipeError):
    """A malformed profile; the message names the file and, for text, the line."""


@dataclass(frozen=True)
class Profile:
    """A model's layers in topological order.

    names: layer names. f, b, w: forward, input-gradient and weight-gradient
    times (ms per microbatch). act_bytes: the bytes a layer's outputs take (kept
    for its backward). param_bytes: its parameter bytes. edges: (i, j) pairs of
    layer indices, i < j, meaning j consumes i's output.
    """

    names: tuple[str, ...]
    f: np.ndarray
    b: np.ndarray
    w: np.ndarray
    act_bytes: np.ndarray
    param_bytes: np.ndarray
    edges: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def work(self) -> np.ndarray:
        """F + B + W of each layer (ms per microbatch)."""
        return self.f + self.b + self.w

    def cut_bytes(self) -> np.ndarray:
        """bytes[k]: what a cut between layers k and k+1 carries (k = 0..L-2)."""
        n = len(self)
        last_consumer = np.arange(n)
        for i, j in self.edges:
            last_consumer[i] = max(last_consumer[i], j)
        delta = np.zeros(n + 1)
        for i in range(n):
            if last_consumer[i] > i:  # crosses every cut from i to last_consumer - 1
                delta[i] += self.act_bytes[i]
                delta[last_consumer[i]] -= self.act_bytes[i]
        return np.cumsum(delta)[: n - 1]


_NODE_RE = re.compile(r"^\s*(\S+)\s+--\s+(.*?)\s+--\s+(\w+=.*?)\s*$")
_EDGE_RE = re.compile(r"^\s*(\S+)\s+--\s+(\S+)\s*$")
_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def _number(text: str, where: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ProfileError(f"{where}: {key}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: {key} must be a finite number >= 0, got {text}")
    return value


def _attributes(text: str, where: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        if not sep:
            raise ProfileError(f"{where}: expected key=value, got {part.strip()!r}")
        raw = raw.strip()
        if raw.startswith("["):
            if not raw.endswith("]"):
                raise ProfileError(f"{where}: {key}={raw!r}: a list must end with ']'")
            items = [x for x in raw[1:-1].split(";") if x.strip()]
            values[key] = sum(_number(x.strip(), where, key) for x in items)
        else:
            values[key] = _number(raw, where, key)
    missing = [k for k in _FIELDS if k not in values]
    if missing:
        raise ProfileError(f"{where}: missing {', '.join(missing)} (need {', '.join(_FIELDS)})")
    return values


def _parse_text(text: str, source: str) -> Profile:
    nodes: dict[str, tuple[str, dict[str, float]]] = {}
    edges: list[tuple[str, str, int]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{source}:{lineno}"
        if not line.strip():
            continue
        if m := _NODE_RE.match(line):
            node, name, attrs = m.groups()
            if node in nodes:
                raise ProfileError(f"{where}: node {node!r} is defined twice")
            nodes[node] = (name, _attributes(attrs, where))
        elif m := _EDGE_RE.match(line):
            edges.append((m.group(1), m.group(2), lineno))
        else:
            raise ProfileError(
                f"{where}: expected 'nodeK -- NAME -- forward_compute_time=..., ...' "
                f"or 'nodeA -- nodeB', got {line.strip()[:80]!r}"
            )
    if not nodes:
        raise ProfileError(f"{source}: no node lines")
    index = {node: i for i, node in enumerate(nodes)}
    pairs = []
    for a, b, lineno in edges:
        for node in (a, b):
            if node not in index:
                raise ProfileError(f"{source}:{lineno}: edge names undefined node {node!r}")
        pairs.append((index[a], index[b]))
    attrs = [v for _, v in nodes.values()]
    back = np.array([a["backward_compute_time"] for a in attrs])
    return _ordered(
        source,
        names=[name for name, _ in nodes.values()],
        f=np.array([a["forward_compute_time"] for a in attrs]),
        b=back / 2,
        w=back / 2,
        act=np.array([a["activation_size"] for a in attrs]),
        params=np.array([a["parameter_size"] for a in attrs]),
        edges=pairs,
    )


def _json_number(layer: dict, key: str, where: str) -> float:
    value = layer.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"{where}: {key!r} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: {key!r} must be a finite number >= 0, got {value}")
    return float(value)


def _parse_json(data: object, source: str) -> Profile:
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise ProfileError(f'{source}: expected {{"layers": [...], "edges"?: [[i, j], ...]}}')
    layers = data["layers"]
    if not layers:
        raise ProfileError(f"{source}: 'layers' is empty")
    names, f, b, w, act, params = [], [], [], [], [], []
    for i, layer in enumerate(layers):
        where = f"{source}: layers[{i}]"
        if not isinstance(layer, dict):
            raise ProfileError(f"{where}: expected an object, got {layer!r}")
        names.append(str(layer.get("name", f"layer{i}")))
        f.append(_json_number(layer, "f", where))
        back = _json_number(layer, "b", where)
        if "w" in layer:
            b.append(back)
            w.append(_json_number(layer, "w", where))
        else:
            b.append(back / 2)
            w.append(back / 2)
        act.append(_json_number(layer, "act_bytes", where))
        params.append(_json_number(layer, "param_bytes", where))
    raw_edges = data.get("edges", [[i, i + 1] for i in range(len(layers) - 1)])
    if not isinstance(raw_edges, list):
        raise ProfileError(f"{source}: 'edges' must be a list of [i, j] pairs")
    pairs = []
    for k, e in enumerate(raw_edges):
        ok = isinstance(e, list) and len(e) == 2 and all(type(x) is int for x in e)
        if not ok or not all(0 <= x < len(layers) for x in e):
            raise ProfileError(
                f"{source}: edges[{k}]={e!r} must be [i, j] with 0 <= i, j < {len(layers)}"
            )
        pairs.append((e[0], e[1]))
    return _ordered(source, names, *map(np.array, (f, b, w, act, params)), edges=pairs)


def _ordered(source, names, f, b, w, act, params, edges) -> Profile:
    """Renumber nodes (in file order) into the stable topological order."""
    n = len(names)
    succ: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for i, j in set(edges):
        if i == j:
            raise ProfileError(f"{source}: edge from node {names[i]!r} to itself")
        succ[i].append(j)
        indegree[j] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < n:
        stuck = [names[i] for i in range(n) if indegree[i] > 0][:3]
        raise ProfileError(f"{source}: the edges form a cycle (through {', '.join(stuck)})")
    pos = {node: k for k, node in enumerate(order)}
    return Profile(
        names=tuple(names[i] for i in order),
        f=f[order],
        b=b[order],
        w=w[order],
        act_bytes=act[order],
        param_bytes=params[order],
        edges=tuple(sorted({(pos[i], pos[j]) for i, j in edges})),
    )


def parse_profile(text: str, source: str = "<profile>") -> Profile:
    """Parse a profile given as text: JSON if it starts with '{', else the DAPPLE format."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{source}:{e.lineno}: malformed JSON: {e.msg}") from None
        return _parse_json(data, source)
    return _parse_text(text, source)


def load_profile(path: str | Path) -> Profile:
    """Read and parse a profile file (see the module docstring for both forms)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"--profile: cannot read {str(path)!r}: {e.strerror}") from None
    return parse_profile(text, str(path))


SHIPPED = Path(__file__).parent / "profiles"


def shipped_profile(name: str) -> Profile:
    """One of the published V100 profiles shipped with the package: 'vgg-19', 'bert-24', 'gnmt-16'."""
    matches = sorted(SHIPPED.glob(f"{name}-pbs-*.txt"))
    if not matches:
        options = sorted(p.name.split("-pbs-")[0] for p in SHIPPED.glob("*.txt"))
        raise ProfileError(f"no shipped profile {name!r}; choose one of {', '.join(options)}")
    return load_profile(matches[0])
