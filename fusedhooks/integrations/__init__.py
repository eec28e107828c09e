"""Integrations with training frameworks and loggers; each module imports its framework, fusedhooks itself none."""
