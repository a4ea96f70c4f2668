"""Browser tests: Playwright driving headless Debian Chromium against a live orchestrator's admin."""
