"""The chaos soak: a seeded fleet under kill -9 and SIGTERM, audited for lost and twice-completed jobs."""
