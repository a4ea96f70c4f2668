"""The kernel below every app: error types, HTTP plumbing, the outbox, admin helpers. Imports no app."""
