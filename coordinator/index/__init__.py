"""The prefix index: Redis store, event-stream follower, in-memory mirror."""
