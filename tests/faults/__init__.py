"""The fault harness (`harness`) and its short runs, one per fault kind (`test_faults`)."""
