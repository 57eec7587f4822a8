"""Step time and wire bytes of a layout: compute, communication per axis, pipeline bubble, overlap."""
