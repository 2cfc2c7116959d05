"""The data sources' one error type (its own module: the loaders and the scheme plug-ins both raise it)."""


class DataError(ValueError):
    """A data source cannot be read or one of its rows breaks the data contract."""
