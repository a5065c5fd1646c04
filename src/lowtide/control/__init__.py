"""The control loop: ports (Protocols), snapshot building, the actuator and pacing. No concrete I/O."""
