"""The package's version (its own module: modules the package imports record it)."""

__version__ = '0.2.0'
