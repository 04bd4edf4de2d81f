"""The operators of the equation on a discretised domain: attention, feed-forward, projection.

The modules are imported by their own names (`itde._operators._attention`, ...); the
public names are `itde`'s."""
