"""Mutation testing of the core modules with mutmut 3, in a private copy of the repository.

``python -m tests.mutation [module ...]``; see docs/development.md.
"""
