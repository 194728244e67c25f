//go:build !unix

package benchlab

import "time"

// ProcessCPU is not measured on this platform: CPU figures are 0.
func ProcessCPU() time.Duration { return 0 }
