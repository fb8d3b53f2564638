"""The bottom plane: timeouts, environment variables and log names that every other package shares.

Imports nothing of the project.
"""
