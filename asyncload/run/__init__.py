"""One epoch in this process: the producer on the event loop, decode jobs on threads, the failure policy and the hand-out to the user."""
