"""Pipeline schedules (and, later, stage partitioning and p2p communication)."""
