"""Pure decisions over an immutable snapshot. No I/O, no sleeping, no clock reads: time is `snapshot.now`."""
