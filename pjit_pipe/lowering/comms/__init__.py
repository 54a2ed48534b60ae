"""Messages and routes: what crosses a stage boundary, on which devices, through which ppermutes."""
