"""Pure values and state machines: ids, GPUs, job specs, lifecycle enums. No I/O, no clock."""
