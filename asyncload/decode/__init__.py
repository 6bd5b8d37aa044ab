"""Bytes to arrays: the default image decoder, its antialiased resize, and the batched GPU decoder;
``budget.py`` bounds what a decode may take (checked from the header, ``headers.py``)."""
