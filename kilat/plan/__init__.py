"""``kilat plan``: hardware-aware capacity and roofline planning (:mod:`.planner`, :mod:`.estimate`,
:mod:`.hardware`)."""
