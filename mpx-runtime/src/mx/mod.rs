//! OCP Microscaling (MX) block formats: element codecs, block quantization, packed tensors.
