"""Adapters that plug mambatitan's models into other trainers (torchtitan: integrations/torchtitan)."""
