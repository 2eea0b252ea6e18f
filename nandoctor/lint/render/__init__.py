"""Output formats of `nandoctor lint`: each reads a `LintResult` and computes nothing new.

`terminal` prints for people, `json_report` and `sarif` return text for machines (SARIF
2.1.0 is what GitHub code scanning uploads).
"""
