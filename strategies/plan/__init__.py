"""The planner's models of a run before it starts: what a rank holds (memory.py) and how long a step takes
(step_time.py) under a layout, from the model's declared shapes (shapes.py), not from running it."""
