"""Per-rank device (and host) memory of a layout: model states, activations, offload."""
