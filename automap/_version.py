"""automap's version: one place, read by the package, plan files and the plan cache key."""

__version__ = "0.1.0"
