"""The request router's Ray Serve glue: ``prefix_affinity.PrefixAffinityRouter`` and the rank lists
(``ranks``) every router of this project hands Serve. The policy it runs is ``routing/``, free of Ray.
"""
