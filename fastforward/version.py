"""The package version, in a module of its own so that modules below the package face can name it without
importing ``fastforward`` (the face) itself."""

__version__ = "0.1.0"
