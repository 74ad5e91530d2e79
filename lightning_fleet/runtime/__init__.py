"""Applying a Plan: DeepSpeed configuration (pure), runtime limits fed back to the planner."""
