"""Where samples land: the layout of a sample's fields and the ring of preallocated batch buffers."""
