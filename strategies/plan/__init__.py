"""The planner's models of a run before it starts: what a rank holds (memory.py) and how long a step takes
(step_time.py) under a layout, from the model's declared shapes (shapes.py), not from running it; and what
each rank's shards hold, read off the model sharded on the meta device (shards_on_meta.py)."""
