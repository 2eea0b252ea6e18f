"""Renderers: read a `Report`, write it for people (terminal, Markdown) or tools (JUnit)."""
