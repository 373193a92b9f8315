"""Private implementation of ctrainstate in one-way layers (DESIGN.md, "Layers"); the public
modules re-export from here."""
