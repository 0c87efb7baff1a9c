"""The ``gradsync`` command line: ``gradsync run`` (the launcher) and ``gradsync bench``."""

__all__: list[str] = []
