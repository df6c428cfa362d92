"""tactics: schedules of partitioning tactics (manual, data parallel, Megatron,
FSDP/ZeRO, sequence and expert parallel) that rewrite a `partir.Partitioning`."""
