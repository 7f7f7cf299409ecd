"""Authorization (#41): who may call whom, decided at the destination's node proxy."""
