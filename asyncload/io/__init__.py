"""Reading bytes: the event-loop reader with retries and timeouts, blocking calls off the loop, object-store clients
(and a bucket's region), the lock a node's processes share. The disk caches are ``cache/``."""
