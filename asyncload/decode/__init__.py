"""Bytes to arrays: the default image decoder, its antialiased resize, and the batched GPU decoder."""
