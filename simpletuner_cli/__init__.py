"""The `simpletuner` command line: `simpletuner server` runs the orchestrator, `simpletuner worker` the agent."""
