//go:build !unix

package benchlab

import "time"

// processCPU is not measured on this platform: CPU figures are 0.
func processCPU() time.Duration { return 0 }
