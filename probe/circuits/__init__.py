"""Weight-based circuit scores (composition, copying) and the `circuits` analysis that ties them to head classes."""

from probe.circuits.composition import (Composition, HeadWeights, all_layer_weights, composition_scores,
                                        copying_scores, layer_weights, random_baseline)

__all__ = ["Composition", "HeadWeights", "all_layer_weights", "composition_scores", "copying_scores",
           "layer_weights", "random_baseline"]
