"""The package version, in a module of its own so that any kvlab module can read it without importing kvlab."""

__version__ = "0.2.0"
