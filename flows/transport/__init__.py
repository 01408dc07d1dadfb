"""Moving things to and from a host: SSH with pinned host keys, the probe, deploy, pull, the local sandbox hosts."""
