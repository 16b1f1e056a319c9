"""Frozen copies of the schedule generators as of commit 425e2eb, before they were made faster.

The oracle of `tests/schedules/test_generator_identity.py`: the fast generators must return
the very same `Schedule` (streams, instructions, name, placement) and refuse the same inputs
with the same errors. Each module is its `schedules/` original verbatim but for the import
of `emit_steps`, which points at the copy here. Never edit them to follow the fast code.
"""
