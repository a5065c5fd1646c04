"""The outside world, one seam each: executors, storage, GPU discovery, templates."""
