"""Model loading, the batch engine and the Ray worker actors (server side)."""
