"""Profiling: what a device measures of itself (compute, memory, disk, host, frames) for the planner."""
