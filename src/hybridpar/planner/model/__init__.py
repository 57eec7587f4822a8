"""What is planned: layout, workload, rank parameter shapes, MoE, selective AC and HSDP groups."""
