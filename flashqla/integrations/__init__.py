"""Hooks that let other libraries run flashqla's kernels: ``flashqla.integrations.fla`` (FLA's backend registry)."""
