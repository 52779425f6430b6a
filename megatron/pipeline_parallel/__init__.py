"""Pipeline parallelism: stage partitioning and interleaved model chunks (``partition``), schedules as
per-rank action tables and their simulator (``schedule_tables``), batched p2p communication between
stages (``p2p``), and the executors that run a step's micro-batches (``schedules``)."""
