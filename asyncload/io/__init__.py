"""Reading bytes: the event-loop reader with retries and timeouts, blocking calls off the loop, object-store clients, the shard stream and its disk cache."""
