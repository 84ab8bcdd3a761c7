"""One module per parallel technique, each an `apply_*` function that changes a module (or wraps it) in
place; strategies/parallelize.py calls them in their one valid order."""
