"""One exception type for everything a user can get wrong; the CLI prints it as one line."""


class VitconvertError(Exception):
    """A problem with the user's input (names, paths, files, options), explained in one sentence."""
