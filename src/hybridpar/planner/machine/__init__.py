"""The machine: device specs and cluster shape, kernel efficiency, allocator overhead, calibration."""
