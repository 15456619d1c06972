"""Distilling the embedded draft from the embedded target (issue 3)."""
